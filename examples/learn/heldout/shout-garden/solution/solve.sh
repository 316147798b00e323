#!/bin/bash
echo GARDEN > /app/answer.txt
