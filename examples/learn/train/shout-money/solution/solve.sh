#!/bin/bash
echo MONEY > /app/answer.txt
