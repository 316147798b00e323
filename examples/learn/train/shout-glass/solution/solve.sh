#!/bin/bash
echo GLASS > /app/answer.txt
