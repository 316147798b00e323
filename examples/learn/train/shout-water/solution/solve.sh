#!/bin/bash
echo WATER > /app/answer.txt
