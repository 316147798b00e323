#!/bin/bash
echo SILVER > /app/answer.txt
