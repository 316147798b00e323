#!/bin/bash
echo MUSIC > /app/answer.txt
