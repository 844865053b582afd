#!/usr/bin/env bash
# Prints k8s/templates/apiserver-egress.yaml with this cluster's API server addresses in
# place of the placeholders (the template says why it is an install-time value):
#
#   bash scripts/k8s_apiserver_egress.sh | kubectl apply -f -
#
# Reads `kubectl get endpoints kubernetes` and `kubectl get service kubernetes` in the
# namespace "default" (where the API server publishes them); uses the current kubectl
# context. Fails, printing nothing, when an address cannot be read: never a wider rule.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
template="$here/k8s/templates/apiserver-egress.yaml"
get() { kubectl get "$1" kubernetes -n default -o "jsonpath=$2"; }
endpoints="$(get endpoints '{range .subsets[*]}{range .addresses[*]}{.ip}{" "}{end}{end}')"
endpoint_port="$(get endpoints '{.subsets[0].ports[0].port}')"
service_ip="$(get service '{.spec.clusterIP}')"
service_port="$(get service '{.spec.ports[0].port}')"
if [ -z "${endpoints// /}" ] || [ -z "$endpoint_port" ] || [ -z "$service_ip" ] \
    || [ -z "$service_port" ]; then
  echo "could not read the API server's addresses (kubectl get endpoints/service kubernetes" \
       "-n default): got endpoints='$endpoints' port='$endpoint_port'" \
       "service='$service_ip:$service_port'" >&2
  exit 1
fi
cidr() { case "$1" in *:*) echo "$1/128" ;; *) echo "$1/32" ;; esac; }
blocks=""
for ip in $endpoints; do blocks="$blocks $(cidr "$ip")"; done
awk -v blocks="$blocks" -v eport="$endpoint_port" -v sip="$(cidr "$service_ip")" \
    -v sport="$service_port" '
  /# API_SERVER_ENDPOINT$/ {
    indent = $0; sub(/-.*/, "", indent)
    n = split(blocks, b, " ")
    for (i = 1; i <= n; i++) if (b[i] != "") print indent "- ipBlock: {cidr: " b[i] "}"
    next }
  /# API_SERVER_ENDPOINT_PORT$/ { sub(/port: [0-9]+/, "port: " eport); sub(/  # .*/, ""); print; next }
  /# API_SERVER_SERVICE_IP$/ { sub(/cidr: [^}]+/, "cidr: " sip); sub(/  # .*/, ""); print; next }
  /# API_SERVER_SERVICE_PORT$/ { sub(/port: [0-9]+/, "port: " sport); sub(/  # .*/, ""); print; next }
  { print }' "$template"
