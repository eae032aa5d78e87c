#!/bin/bash
find /app/conf -type f -name '*.conf' -exec sed -i 's/db\.staging\.internal/db.prod.internal/g' {} +
