#!/bin/bash
echo BREAD > /app/answer.txt
