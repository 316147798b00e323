#!/bin/bash
echo CHAIR > /app/answer.txt
