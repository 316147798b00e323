#!/bin/bash
echo GREEN > /app/answer.txt
