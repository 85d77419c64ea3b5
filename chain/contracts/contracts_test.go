package contracts

import (
	"bytes"
	"encoding/hex"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/accounts/abi"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
)

func TestSelectorsMatchTheWireFacts(t *testing.T) {
	tests := []struct {
		contract string
		parsed   abi.ABI
		method   string
		want     string
	}{
		{"proxy", ProxyABI, "settle", "13cd3b53"},
		{"proxy", ProxyABI, "settleWithPermit", "fa340378"},
		{"proxy", ProxyABI, "PERMIT2", "6afdd850"},
		// The upto proxy's, as the public @x402/evm 2.27 ABI gives them (viem's toFunctionSelector).
		{"upto proxy", UptoProxyABI, "settle", "ff11e7b4"},
		{"upto proxy", UptoProxyABI, "settleWithPermit", "016c1748"},
		{"upto proxy", UptoProxyABI, "PERMIT2", "6afdd850"},
		{"upto proxy", UptoProxyABI, "WITNESS_TYPEHASH", "2c03ae6a"},
		{"upto proxy", UptoProxyABI, "WITNESS_TYPE_STRING", "156e2152"},
		{"token", StableCoinABI, "permit", "d505accf"},
		{"token", StableCoinABI, "transferFrom", "23b872dd"},
		{"token", StableCoinABI, "nonces", "7ecebe00"},
		{"token", StableCoinABI, "mint", "40c10f19"},
		{"permit2", Permit2ABI, "permitWitnessTransferFrom", "137c29fe"},
		{"permit2", Permit2ABI, "permitTransferFrom", "30f28b7a"},
		{"permit2", Permit2ABI, "nonceBitmap", "4fe02b44"},
		{"permit2", Permit2ABI, "invalidateUnorderedNonces", "3ff9dcb1"},
		{"permit2", Permit2ABI, "DOMAIN_SEPARATOR", "3644e515"},
		// tryAggregate as the public @x402/evm 2.27 SDK's multicall helper declares it, aggregate3 as viem's
		// multicall3Abi (viem's toFunctionSelector of each).
		{"multicall3", Multicall3ABI, "tryAggregate", "bce38bd7"},
		{"multicall3", Multicall3ABI, "aggregate3", "82ad56cb"},
	}
	for _, tt := range tests {
		m, ok := tt.parsed.Methods[tt.method]
		if !ok {
			t.Errorf("%s ABI has no method %s", tt.contract, tt.method)
			continue
		}
		if got := hex.EncodeToString(m.ID); got != tt.want {
			t.Errorf("%s.%s selector = 0x%s (%s), want 0x%s", tt.contract, tt.method, got, m.Sig, tt.want)
		}
	}
}

func TestWitnessTypeStringGivesTheTypehashesOfTheWireFacts(t *testing.T) {
	full := "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline," + witnessTypeString
	tests := []struct{ typ, want string }{
		{full, "0xebc156cd23678a74c94df13d772ef5478420637f0c94bd10d509e1dc98f521c7"},
		{"TokenPermissions(address token,uint256 amount)", "0x618358ac3db8dc274f0cd8829da7e234bd48cd73c4a740aede1adec9846d06a1"},
		{"Witness(address to,uint256 validAfter)", "0xd97b3239a7f32295517bd14cb074edfdd188dfe5eb42f802bb26d4fd1eb12c37"},
	}
	for _, tt := range tests {
		if got := crypto.Keccak256Hash([]byte(tt.typ)).Hex(); got != tt.want {
			t.Errorf("keccak(%q) = %s, want %s", tt.typ, got, tt.want)
		}
	}
}

func TestUptoWitnessTypeStringGivesTheTypehashesOfTheTypeScriptClient(t *testing.T) {
	// Pinned from viem's keccak256 of the type strings of @x402/evm 2.27's uptoPermit2WitnessTypes.
	const tail = "Witness witness)TokenPermissions(address token,uint256 amount)Witness(address to,address facilitator,uint256 validAfter)"
	full := "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline," + tail
	tests := []struct{ typ, want string }{
		{full, "0x51dff6974ad4388c499e7fcfe838d2bd767162553a144098ce20ea661d70c2ee"},
		{"Witness(address to,address facilitator,uint256 validAfter)", "0xd4171c445a74218b01d4fd8af34ff1106580ea1e36ff837e64484bfaa2253b75"},
	}
	for _, tt := range tests {
		if got := crypto.Keccak256Hash([]byte(tt.typ)).Hex(); got != tt.want {
			t.Errorf("keccak(%q) = %s, want %s", tt.typ, got, tt.want)
		}
	}
	for _, name := range []string{"AmountExceedsPermitted", "UnauthorizedFacilitator", "InvalidDestination", "InvalidOwner", "PaymentTooEarly", "Permit2612AmountMismatch"} {
		if _, ok := UptoProxyABI.Errors[name]; !ok {
			t.Errorf("the upto proxy ABI lacks the error %s of the public ABI", name)
		}
	}
}

func TestPackUptoSettleCarriesTheAmountAndTheFacilitator(t *testing.T) {
	permit := PermitTransferFrom{
		Permitted: TokenPermissions{Token: common.HexToAddress("0x01"), Amount: big.NewInt(1000)},
		Nonce:     big.NewInt(7),
		Deadline:  big.NewInt(1_900_000_000),
	}
	witness := UptoWitness{To: common.HexToAddress("0x02"), Facilitator: common.HexToAddress("0x04"), ValidAfter: big.NewInt(0)}
	sig := bytes.Repeat([]byte{1}, 65)
	data, err := PackUptoSettle(permit, big.NewInt(250), common.HexToAddress("0x03"), witness, sig)
	if err != nil {
		t.Fatal(err)
	}
	args, err := UptoProxyABI.Methods["settle"].Inputs.Unpack(data[4:])
	if err != nil {
		t.Fatal(err)
	}
	if amount := args[1].(*big.Int); amount.Int64() != 250 {
		t.Errorf("amount round-tripped as %s", amount)
	}
	if got := reflect.ValueOf(args[3]).FieldByName("Facilitator").Interface().(common.Address); got != witness.Facilitator {
		t.Errorf("witness.facilitator round-tripped as %s", got)
	}
	data, err = PackUptoSettleWithPermit(EIP2612Permit{Value: big.NewInt(1000), Deadline: big.NewInt(1), V: 27}, permit, big.NewInt(250), common.HexToAddress("0x03"), witness, sig)
	if err != nil {
		t.Fatal(err)
	}
	if got := hex.EncodeToString(data[:4]); got != "016c1748" {
		t.Errorf("upto settleWithPermit calldata starts with 0x%s, want 0x016c1748", got)
	}
}

func TestGenesisAllocPlacesRuntimeCodeAtTheCanonicalAddresses(t *testing.T) {
	alloc := GenesisAlloc()
	for addr, want := range map[common.Address][]byte{
		Permit2Address: Permit2RuntimeCode(), ProxyAddress: ProxyRuntimeCode(), UptoProxyAddress: UptoProxyRuntimeCode(),
		BatchSettlementAddress: BatchSettlementRuntimeCode(), ERC3009DepositCollectorAddress: ERC3009DepositCollectorRuntimeCode(),
		Permit2DepositCollectorAddress: Permit2DepositCollectorRuntimeCode(), Multicall3Address: Multicall3RuntimeCode(),
	} {
		acc, ok := alloc[addr]
		if !ok {
			t.Fatalf("genesis alloc lacks %s", addr)
		}
		if !bytes.Equal(acc.Code, want) {
			t.Errorf("code at %s is not the runtime code", addr)
		}
	}
	if len(alloc) != 7 {
		t.Errorf("genesis alloc has %d accounts, want 7", len(alloc))
	}
}

func TestCreationCodeEmbedsTheRuntimeCodeOfGenesisContracts(t *testing.T) {
	// Without immutables the constructor copies the runtime code verbatim, which is
	// what makes placing it into genesis equivalent to deploying it.
	for name, pair := range map[string][2][]byte{
		"Permit2":                 {permit2CreationCode(), Permit2RuntimeCode()},
		"Proxy":                   {proxyCreationCode(), ProxyRuntimeCode()},
		"UptoProxy":               {uptoProxyCreationCode(), UptoProxyRuntimeCode()},
		"BatchSettlement":         {bytes.Clone(batchSettlementCreation), BatchSettlementRuntimeCode()},
		"ERC3009DepositCollector": {bytes.Clone(erc3009CollectorCreation), ERC3009DepositCollectorRuntimeCode()},
		"Permit2DepositCollector": {bytes.Clone(permit2CollectorCreation), Permit2DepositCollectorRuntimeCode()},
		"Multicall3":              {bytes.Clone(multicall3Creation), Multicall3RuntimeCode()},
	} {
		if !bytes.Contains(pair[0], pair[1]) {
			t.Errorf("%s creation code does not contain its runtime code", name)
		}
	}
}

func TestCodeAccessorsReturnCopies(t *testing.T) {
	code := Permit2RuntimeCode()
	code[0] ^= 0xff
	if bytes.Equal(code, Permit2RuntimeCode()) {
		t.Fatal("mutating a returned slice changed the package's bytecode")
	}
}

func TestPackSettleStartsWithTheSettleSelector(t *testing.T) {
	permit := PermitTransferFrom{
		Permitted: TokenPermissions{Token: common.HexToAddress("0x01"), Amount: big.NewInt(1000)},
		Nonce:     big.NewInt(7),
		Deadline:  big.NewInt(1_900_000_000),
	}
	witness := Witness{To: common.HexToAddress("0x02"), ValidAfter: big.NewInt(0)}
	sig := bytes.Repeat([]byte{1}, 65)

	data, err := PackSettle(permit, common.HexToAddress("0x03"), witness, sig)
	if err != nil {
		t.Fatal(err)
	}
	if got := hex.EncodeToString(data[:4]); got != "13cd3b53" {
		t.Errorf("settle calldata starts with 0x%s, want 0x13cd3b53", got)
	}
	args, err := ProxyABI.Methods["settle"].Inputs.Unpack(data[4:])
	if err != nil {
		t.Fatal(err)
	}
	if owner := args[1].(common.Address); owner != common.HexToAddress("0x03") {
		t.Errorf("owner round-tripped as %s", owner)
	}

	data, err = PackSettleWithPermit(EIP2612Permit{Value: big.NewInt(1000), Deadline: big.NewInt(1), V: 27}, permit, common.HexToAddress("0x03"), witness, sig)
	if err != nil {
		t.Fatal(err)
	}
	if got := hex.EncodeToString(data[:4]); got != "fa340378" {
		t.Errorf("settleWithPermit calldata starts with 0x%s, want 0xfa340378", got)
	}
}

func TestDecodeRevertNamesCustomErrorsAndReasonStrings(t *testing.T) {
	tooEarly := ProxyABI.Errors["PaymentTooEarly"].ID
	expiredID := Permit2ABI.Errors["SignatureExpired"].ID
	expired, err := Permit2ABI.Errors["SignatureExpired"].Inputs.Pack(big.NewInt(42))
	if err != nil {
		t.Fatal(err)
	}
	reason, err := abi.NewType("string", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := abi.Arguments{{Type: reason}}.Pack("boom")
	if err != nil {
		t.Fatal(err)
	}
	empty, err := abi.Arguments{{Type: reason}}.Pack("")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		data   []byte
		want   string
		wantOK bool
	}{
		{tooEarly[:4], "PaymentTooEarly()", true},
		{append(bytes.Clone(expiredID[:4]), expired...), "SignatureExpired(42)", true},
		{append([]byte{0x08, 0xc3, 0x79, 0xa0}, msg...), "boom", true},
		{[]byte{0xde, 0xad, 0xbe, 0xef}, "", false},
		{nil, "", false},
		// An empty reason string names nothing (found by FuzzDecodeRevert, in the second, non-canonical form).
		{append([]byte{0x08, 0xc3, 0x79, 0xa0}, empty...), "", false},
		{append([]byte{0x08, 0xc3, 0x79, 0xa0}, make([]byte, 32)...), "", false},
	}
	for _, tt := range tests {
		got, ok := DecodeRevert(tt.data)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("DecodeRevert(%x) = %q, %v; want %q, %v", tt.data, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestCommittedArtifactsMatchAFreshBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("compiles with solc-js")
	}
	racepass.Once(t, "its time is solc-js compiling the contracts in node; no Go code of ours runs")
	node := needs.Command(t, "node", "apt-get install nodejs npm")
	if _, err := os.Stat(filepath.Join("node_modules", "solc")); err != nil {
		needs.Missing(t, "chain/contracts/node_modules (the pinned solc-js)", "cd chain/contracts && npm ci (or go generate ./chain/contracts)")
	}
	out := t.TempDir()
	cmd := exec.Command(node, "build.js", out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build.js failed: %v\n%s", err, b)
	}
	committed, err := filepath.Glob(filepath.Join("build", "*"))
	if err != nil || len(committed) == 0 {
		t.Fatalf("no committed artifacts: %v", err)
	}
	for _, path := range committed {
		want, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(out, filepath.Base(path)))
		if err != nil {
			t.Errorf("fresh build lacks %s: %v", filepath.Base(path), err)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from a fresh build: run go generate ./chain/contracts", path)
		}
	}
}

// DecodeRevert names exactly the reverts these contracts and Solidity give (Error(string), Panic(uint256) and the
// custom errors of the three ABIs), with a non-empty reason that depends only on the decoded values and grows at
// most linearly with the data.
func FuzzDecodeRevert(f *testing.F) {
	str, err := abi.NewType("string", "", nil)
	if err != nil {
		f.Fatal(err)
	}
	word, err := abi.NewType("uint256", "", nil)
	if err != nil {
		f.Fatal(err)
	}
	reasonString, panicCode := abi.Arguments{{Type: str}}, abi.Arguments{{Type: word}}
	errorSelector, panicSelector := []byte{0x08, 0xc3, 0x79, 0xa0}, []byte{0x4e, 0x48, 0x7b, 0x71}
	custom := map[[4]byte]abi.Error{}
	for _, parsed := range []*abi.ABI{&ProxyABI, &UptoProxyABI, &BatchSettlementABI, &ERC3009DepositCollectorABI, &Permit2DepositCollectorABI, &Permit2ABI, &StableCoinABI} {
		for _, e := range parsed.Errors {
			custom[[4]byte(e.ID[:4])] = e
			args := make([]any, len(e.Inputs))
			for i, in := range e.Inputs {
				v := reflect.New(in.Type.GetType()).Elem() // the zero value: address 0, uint256 0, ""
				if v.Kind() == reflect.Pointer {
					v = reflect.New(v.Type().Elem())
				}
				args[i] = v.Interface()
			}
			packed, err := e.Inputs.Pack(args...)
			if err != nil {
				f.Fatalf("%s: %v", e.Name, err)
			}
			f.Add(append(bytes.Clone(e.ID[:4]), packed...))
		}
	}
	for _, msg := range []string{"boom", "ERC20: transfer amount exceeds balance"} {
		packed, _ := reasonString.Pack(msg)
		f.Add(append(bytes.Clone(errorSelector), packed...))
	}
	for _, code := range []int64{0x01, 0x11, 0x12, 0x99} {
		packed, _ := panicCode.Pack(big.NewInt(code))
		f.Add(append(bytes.Clone(panicSelector), packed...))
	}
	f.Add([]byte{})
	f.Add([]byte{0xde, 0xad, 0xbe, 0xef})
	f.Add(errorSelector)

	f.Fuzz(func(t *testing.T, data []byte) {
		reason, ok := DecodeRevert(data)
		if again, okAgain := DecodeRevert(data); again != reason || okAgain != ok {
			t.Fatalf("DecodeRevert(%x) is not deterministic: %q, %v then %q, %v", data, reason, ok, again, okAgain)
		}
		if !ok {
			if reason != "" {
				t.Fatalf("DecodeRevert(%x) = %q with ok false", data, reason)
			}
			if len(data) >= 4 {
				if e, known := custom[[4]byte(data[:4])]; known {
					t.Fatalf("DecodeRevert(%x) does not name the custom error %s of its selector", data, e.Name)
				}
			}
			return
		}
		if reason == "" || len(reason) > 4*len(data)+64 {
			t.Fatalf("DecodeRevert(%x) = %q: want a non-empty reason at most linear in the data", data, reason)
		}
		sel := [4]byte(data[:4])
		var canonical []byte // the data packed again from the decoded values
		switch e, known := custom[sel]; {
		case bytes.Equal(sel[:], errorSelector), bytes.Equal(sel[:], panicSelector):
			args := reasonString
			if bytes.Equal(sel[:], panicSelector) {
				args = panicCode
			}
			values, err := args.Unpack(data[4:])
			if err != nil {
				t.Fatalf("DecodeRevert(%x) = %q, but the data does not unpack: %v", data, reason, err)
			}
			packed, _ := args.Pack(values...)
			canonical = append(sel[:], packed...)
		case known:
			if !strings.HasPrefix(reason, e.Name+"(") || !strings.HasSuffix(reason, ")") {
				t.Fatalf("DecodeRevert(%x) = %q, want %s(...)", data, reason, e.Name)
			}
			values, err := e.Inputs.Unpack(data[4:])
			if err != nil {
				return // named without its arguments
			}
			packed, err := e.Inputs.Pack(values...)
			if err != nil {
				t.Fatalf("%s: the decoded values do not pack again: %v", e.Name, err)
			}
			canonical = append(sel[:], packed...)
		default:
			t.Fatalf("DecodeRevert(%x) = %q for selector %x, which no known revert has", data, reason, sel)
		}
		if again, ok := DecodeRevert(canonical); !ok || again != reason {
			t.Fatalf("DecodeRevert(%x) = %q, but the same values packed again give %q, %v", data, reason, again, ok)
		}
	})
}
