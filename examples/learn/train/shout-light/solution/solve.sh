#!/bin/bash
echo LIGHT > /app/answer.txt
