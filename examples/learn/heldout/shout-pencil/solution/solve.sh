#!/bin/bash
echo PENCIL > /app/answer.txt
