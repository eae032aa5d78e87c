#!/bin/bash
cd /app && tar --exclude='project/cache/*' -czf /app/backup.tar.gz project
