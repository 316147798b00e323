#!/bin/bash
echo NIGHT > /app/answer.txt
