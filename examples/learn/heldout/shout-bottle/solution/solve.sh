#!/bin/bash
echo BOTTLE > /app/answer.txt
