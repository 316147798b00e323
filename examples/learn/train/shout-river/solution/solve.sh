#!/bin/bash
echo RIVER > /app/answer.txt
