#!/bin/bash
echo PLANET > /app/answer.txt
