#!/bin/bash
sed -i 's/"\$fil"/"$file"/' /app/wordcount.sh
chmod +x /app/wordcount.sh
