#!/bin/bash
echo TRAIN > /app/answer.txt
