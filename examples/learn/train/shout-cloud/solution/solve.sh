#!/bin/bash
echo CLOUD > /app/answer.txt
