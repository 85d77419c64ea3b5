package x402

// The x402 MCP transport (specs/transports-v2/mcp.md) carries a payment and its settlement in the _meta of MCP
// messages instead of headers.
const (
	// MCPMetaPayment is where a paid tools/call carries its PaymentPayload: params._meta["x402/payment"].
	MCPMetaPayment = "x402/payment"
	// MCPMetaPaymentResponse is where a paid tool result carries its SettleResponse: result._meta["x402/payment-response"].
	MCPMetaPaymentResponse = "x402/payment-response"
	// MCPMetaPrice is where a gate advertises a priced tool's price in a tools/list answer (the tool's _meta),
	// as configured, such as "$0.01": not of the transport's spec, which leaves prices to the PaymentRequired.
	MCPMetaPrice = "x402/price"
)
