#!/bin/bash
echo LEMON > /app/answer.txt
