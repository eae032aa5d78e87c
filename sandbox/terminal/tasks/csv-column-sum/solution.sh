#!/bin/bash
awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "amount") c = i; next }
         { s += $c } END { printf "%.2f\n", s }' /app/sales.csv > /app/total.txt
