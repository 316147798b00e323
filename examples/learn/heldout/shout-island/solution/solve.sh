#!/bin/bash
echo ISLAND > /app/answer.txt
