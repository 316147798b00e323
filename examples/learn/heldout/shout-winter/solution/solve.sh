#!/bin/bash
echo WINTER > /app/answer.txt
