#!/bin/bash
echo PLANT > /app/answer.txt
