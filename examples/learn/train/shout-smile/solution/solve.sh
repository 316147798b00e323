#!/bin/bash
echo SMILE > /app/answer.txt
