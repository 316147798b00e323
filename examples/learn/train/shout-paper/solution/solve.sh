#!/bin/bash
echo PAPER > /app/answer.txt
