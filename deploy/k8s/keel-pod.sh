#!/usr/bin/env bash
# keel-pod COMMAND...: the pod's first process around `keel train`. It passes SIGTERM on (the pause
# checkpoint needs it, and a shell as PID 1 would drop it), exits with the command's code for the Job's
# podFailurePolicy, and on 76 (this node is quarantined) labels the pod's node keel/quarantined=true,
# which the Job's node affinity excludes: the replacement pod is then scheduled on another node.
set -u
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
while kill -0 "$child" 2>/dev/null; do wait "$child"; done  # a trapped signal ends `wait` early
wait "$child"
code=$?
if [ "$code" = 76 ] && [ -n "${KEEL_NODE:-}" ]; then
  sa=/var/run/secrets/kubernetes.io/serviceaccount
  if curl -fsS --max-time 30 --cacert "$sa/ca.crt" -H "Authorization: Bearer $(cat "$sa/token" 2>/dev/null)" \
      -H "Content-Type: application/merge-patch+json" -X PATCH -o /dev/null \
      -d '{"metadata": {"labels": {"keel/quarantined": "true"}}}' \
      "https://kubernetes.default.svc/api/v1/nodes/$KEEL_NODE"; then
    echo "keel-pod: labelled node $KEEL_NODE keel/quarantined=true; the Job recreates this pod on another node"
  else
    echo "keel-pod: could not label node $KEEL_NODE; run: kubectl label node $KEEL_NODE keel/quarantined=true" >&2
  fi
fi
exit "$code"
