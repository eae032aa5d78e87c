#!/bin/bash
chmod 600 /app/private/key.pem
find /app/public -type d -exec chmod 755 {} +
find /app/public -type f -exec chmod 644 {} +
ln -sfn /app/releases/v2 /app/current
