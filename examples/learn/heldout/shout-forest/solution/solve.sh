#!/bin/bash
echo FOREST > /app/answer.txt
