#!/bin/bash
echo HORSE > /app/answer.txt
