package contracts

import (
	"bytes"
	_ "embed"
	"fmt"

	"github.com/ethereum/go-ethereum/common"
)

// Multicall3Address is the canonical Multicall3, the same on every chain. The public SDK's facilitators read
// a batch-settlement channel (its balance and claims, the payer's balance, a pending withdrawal, the refund
// nonce) through its tryAggregate in one eth_call; a dev chain places our own ABI-compatible Multicall3 there
// in genesis.
var Multicall3Address = common.HexToAddress("0xcA11bde05977b3631167028862bE2a173976CA11")

var (
	//go:embed build/Multicall3.abi.json
	multicall3ABIJSON string
	//go:embed build/Multicall3.bin
	multicall3Bin string
	//go:embed build/Multicall3.bin-runtime
	multicall3BinRuntime string
)

var (
	// Multicall3ABI is the ABI of Multicall3 (tryAggregate, aggregate3).
	Multicall3ABI = mustABI("Multicall3", multicall3ABIJSON)

	multicall3Creation = mustHex("Multicall3.bin", multicall3Bin)
	multicall3Runtime  = mustHex("Multicall3.bin-runtime", multicall3BinRuntime)
)

// Multicall3RuntimeCode returns a copy of Multicall3's runtime code, placed at Multicall3Address.
func Multicall3RuntimeCode() []byte { return bytes.Clone(multicall3Runtime) }

// MulticallCall is Multicall3's Call: a target and the calldata sent to it (tryAggregate's rows).
type MulticallCall struct {
	Target   common.Address
	CallData []byte
}

// MulticallCall3 is Multicall3's Call3: a Call whose failure aggregate3 tolerates when AllowFailure is set.
type MulticallCall3 struct {
	Target       common.Address
	AllowFailure bool
	CallData     []byte
}

// MulticallResult is Multicall3's Result: whether a call succeeded, and what it returned (its revert data when
// it failed).
type MulticallResult struct {
	Success    bool
	ReturnData []byte
}

// PackTryAggregate returns the calldata of multicall3.tryAggregate(requireSuccess, calls), as the SDK sends it
// (requireSuccess false).
func PackTryAggregate(requireSuccess bool, calls []MulticallCall) ([]byte, error) {
	data, err := Multicall3ABI.Pack("tryAggregate", requireSuccess, calls)
	if err != nil {
		return nil, fmt.Errorf("packing multicall3 tryAggregate: %w", err)
	}
	return data, nil
}

// PackAggregate3 returns the calldata of multicall3.aggregate3(calls).
func PackAggregate3(calls []MulticallCall3) ([]byte, error) {
	data, err := Multicall3ABI.Pack("aggregate3", calls)
	if err != nil {
		return nil, fmt.Errorf("packing multicall3 aggregate3: %w", err)
	}
	return data, nil
}

// UnpackMulticallResults decodes what tryAggregate or aggregate3 (method) returned: one result per call.
func UnpackMulticallResults(method string, ret []byte) ([]MulticallResult, error) {
	var out struct{ ReturnData []MulticallResult }
	if err := Multicall3ABI.UnpackIntoInterface(&out, method, ret); err != nil {
		return nil, fmt.Errorf("unpacking multicall3 %s: %w", method, err)
	}
	return out.ReturnData, nil
}
