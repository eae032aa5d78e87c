#!/bin/bash
# Prints the number of words in the file $1.
file=$1
wc -w < "$fil" | tr -d ' '
