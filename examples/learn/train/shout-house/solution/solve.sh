#!/bin/bash
echo HOUSE > /app/answer.txt
