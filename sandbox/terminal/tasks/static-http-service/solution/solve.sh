#!/bin/bash
printf 'ok\n' > /app/site/health
nohup python3 -m http.server 8080 --bind 127.0.0.1 --directory /app/site \
  >/tmp/http.log 2>&1 &
for _ in $(seq 50); do
  python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8080/health")' \
    2>/dev/null && exit 0
  sleep 0.1
done
echo "the server did not come up" >&2
exit 1
