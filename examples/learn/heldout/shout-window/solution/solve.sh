#!/bin/bash
echo WINDOW > /app/answer.txt
