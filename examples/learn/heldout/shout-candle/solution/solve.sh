#!/bin/bash
echo CANDLE > /app/answer.txt
