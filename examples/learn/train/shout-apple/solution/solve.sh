#!/bin/bash
echo APPLE > /app/answer.txt
