#!/bin/bash
echo SUGAR > /app/answer.txt
