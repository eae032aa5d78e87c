#!/bin/bash
awk '{print $9}' /app/access.log | sort | uniq -c | awk '{print $2, $1}' \
  | sort -k2,2nr -k1,1n > /app/report.txt
