// Validates every object of a rendered manifest stream (JSON list on stdin, made by the
// test from `kubectl kustomize` output) against the Kubernetes schemas of kubernetes-models,
// and the Prometheus Operator CRDs against @kubernetes-models/prometheus-operator.
// Prints one line per object; exits 1 when any object fails or has no known schema.
"use strict";
const path = require("path");
const modules = process.argv[2] || path.join(__dirname, "node_modules");
const req = (name) => require(path.join(modules, name));

function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return req(`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`)[kind];
  }
  const dir = group === "" ? version : `${group}/${version}`;
  return req(`kubernetes-models/${dir}/${kind}`)[kind];
}

const objects = JSON.parse(require("fs").readFileSync(0, "utf8"));
let failed = 0;
for (const obj of objects) {
  const label = `${obj.kind}/${obj.metadata && obj.metadata.name}`;
  try {
    const Model = modelFor(obj.apiVersion, obj.kind);
    new Model(obj).validate();
    console.log(`ok ${label}`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${label}: ${e.message}`);
  }
}
if (objects.length === 0) { console.log("FAIL: no objects"); failed++; }
process.exit(failed ? 1 : 0);
