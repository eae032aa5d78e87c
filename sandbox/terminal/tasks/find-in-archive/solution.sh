#!/bin/bash
mkdir -p /app/extracted
tar -xzf /app/incoming.tar.gz -C /app/extracted
grep -rh '^TOKEN=' /app/extracted | head -n1 | cut -d= -f2- > /app/answer.txt
