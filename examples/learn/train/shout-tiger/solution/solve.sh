#!/bin/bash
echo TIGER > /app/answer.txt
