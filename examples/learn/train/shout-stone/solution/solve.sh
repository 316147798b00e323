#!/bin/bash
echo STONE > /app/answer.txt
