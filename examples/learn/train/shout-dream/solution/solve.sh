#!/bin/bash
echo DREAM > /app/answer.txt
