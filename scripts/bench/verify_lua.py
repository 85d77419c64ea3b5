#!/usr/bin/env python3
"""Writes a wrk script that POSTs /facilitator/verify with the payments in a folder (one PAYMENT-SIGNATURE
header value per file), each as {x402Version, paymentPayload, paymentRequirements: its accepted}, in turn."""
import base64, glob, json, sys

bodies = []
for f in sorted(glob.glob(sys.argv[1] + '/*.txt')):
    h = open(f).read().strip()
    if h:
        p = json.loads(base64.b64decode(h))
        bodies.append(json.dumps({"x402Version": 2, "paymentPayload": p, "paymentRequirements": p["accepted"]},
                                 separators=(',', ':')))
print('bodies = {\n' + ',\n'.join('[==[%s]==]' % b for b in bodies) + '\n}')
print(open(sys.argv[2]).read())
