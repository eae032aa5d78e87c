#!/bin/bash
set -e
mkdir -p /app/sorted/text /app/sorted/data /app/sorted/logs
mv /app/inbox/*.txt /app/sorted/text/
mv /app/inbox/*.csv /app/sorted/data/
mv /app/inbox/*.log /app/sorted/logs/
