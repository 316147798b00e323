#!/bin/bash
echo TABLE > /app/answer.txt
