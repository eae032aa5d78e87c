#!/bin/bash
cat > /app/bin/greet <<'SH'
#!/bin/sh
if [ $# -lt 1 ]; then
  echo "usage: greet NAME" >&2
  exit 2
fi
echo "Hello, $1!"
SH
chmod +x /app/bin/greet
