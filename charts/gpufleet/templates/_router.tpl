{{- define "gpufleet.router.name" -}}gpufleet-router{{- end -}}

{{- define "gpufleet.router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpufleet.router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpufleet.router.labels" -}}
{{ include "gpufleet.router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpufleet
app.kubernetes.io/component: router
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpufleet.router.serviceAccountName" -}}
{{- default "gpufleet-router" .Values.router.serviceAccount.name -}}
{{- end -}}

{{- /* The routers' rules, in a ClusterRole (rbac.scope Cluster) or a Role per namespace (Namespaced). */ -}}
{{- define "gpufleet.router.rules" -}}
- apiGroups: [serving.gpufleet.dev]
  resources: [inferenceservices, inferenceadapters, inferencetenants]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- if .Values.router.tenants.readKeySecrets }}
# The tenants' key hashes (docs/tenants.md, "Keys"). The routers watch only Secrets labelled
# gpufleet.dev/tenant-keys=true (a label-selected watch), but RBAC cannot grant by label: this lets them
# read every Secret where the rules apply (the cluster with rbac.scope Cluster, each routed namespace
# with Namespaced). router.tenants.readKeySecrets=false drops it (identity: Trusted needs no Secret).
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch]
{{- end }}
{{- end -}}
