#!/bin/bash
echo ROCKET > /app/answer.txt
