#!/bin/bash
echo OCEAN > /app/answer.txt
