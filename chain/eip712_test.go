package chain

import (
	"fmt"
	"math/big"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"

	"github.com/x402-gateway/caddy-x402/x402"
)

func referenceDigest(t testing.TB, td apitypes.TypedData) common.Hash {
	t.Helper()
	h, _, err := apitypes.TypedDataAndHash(td)
	if err != nil {
		t.Fatalf("apitypes hashing: %v", err)
	}
	return common.BytesToHash(h)
}

// randUint256 draws a number that is sometimes an edge (0, 1, 2^256-1), sometimes small, sometimes full width.
func randUint256(r *rand.Rand) *big.Int {
	switch r.IntN(6) {
	case 0:
		return big.NewInt(0)
	case 1:
		return big.NewInt(1)
	case 2:
		return new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	case 3:
		return new(big.Int).SetUint64(r.Uint64())
	}
	var b [32]byte
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return new(big.Int).SetBytes(b[:])
}

func randAddress(r *rand.Rand) common.Address {
	var a common.Address
	for i := range a {
		a[i] = byte(r.Uint32())
	}
	return a
}

func randString(r *rand.Rand) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .-_é€"
	runes := []rune(alphabet)
	n := 1 + r.IntN(24)
	out := make([]rune, n)
	for i := range out {
		out[i] = runes[r.IntN(len(runes))]
	}
	return string(out)
}

func randChainID(r *rand.Rand) *big.Int {
	switch r.IntN(4) {
	case 0:
		return big.NewInt(72344)
	case 1:
		return big.NewInt(723487)
	case 2:
		return new(big.Int).SetUint64(1 + r.Uint64())
	}
	return new(big.Int).SetBit(randUint256(r), 0, 1) // any odd, hence non-zero, uint256
}

func TestTypeHashesEqualThePublishedValues(t *testing.T) {
	cases := []struct {
		name string
		got  common.Hash
		want string
	}{
		{"Permit", permitTypeHash, "0x6e71edae12b1b97f4d1f60370fef10105fa2faae0126114a169c64845d6126c9"},
		{"PermitWitnessTransferFrom", permitWitnessTransferFromTypeHash, "0xebc156cd23678a74c94df13d772ef5478420637f0c94bd10d509e1dc98f521c7"},
		{"TokenPermissions", tokenPermissionsTypeHash, "0x618358ac3db8dc274f0cd8829da7e234bd48cd73c4a740aede1adec9846d06a1"},
		{"Witness", witnessTypeHash, "0xd97b3239a7f32295517bd14cb074edfdd188dfe5eb42f802bb26d4fd1eb12c37"},
		// The two domain type hashes are those of OpenZeppelin's EIP712 and of Permit2's EIP712 contract.
		{"EIP712Domain with version", permitDomainTypeHash, "0x8b73c3c69bb8fe3d512ecc4cf759cc79239f7b179b0ffacaa9a75d522b39400f"},
		{"EIP712Domain of Permit2", permit2DomainTypeHash, "0x8cad95687ba82c2ce50e74f7b754645e5117c3a5bec8151c0726d5857980a866"},
	}
	for _, c := range cases {
		if c.got != common.HexToHash(c.want) {
			t.Errorf("%s type hash = %s, want %s", c.name, c.got, c.want)
		}
	}
}

func TestPermit2WitnessTypeStringCompletesThePermit2TypePrefix(t *testing.T) {
	// Permit2 hashes "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline,"
	// followed by the witness type string; the result must be the type we sign.
	const stub = "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline,"
	if got := stub + permit2WitnessTypeString; got != permitWitnessTransferFromType {
		t.Fatalf("stub + witness type string = %q, want %q", got, permitWitnessTransferFromType)
	}
}

func TestPermitDigestMatchesGoEthereumTypedDataHashing(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 300 {
		name, version := randString(r), randString(r)
		chainID, token := randChainID(r), randAddress(r)
		p := Permit{
			Owner:    randAddress(r),
			Spender:  randAddress(r),
			Value:    randUint256(r),
			Nonce:    randUint256(r),
			Deadline: randUint256(r),
		}
		got := PermitDigest(PermitDomainSeparator(name, version, chainID, token), p)
		want := referenceDigest(t, chaintest.PermitTypedData(name, version, chainID, token,
			p.Owner.Hex(), p.Spender.Hex(), p.Value.String(), p.Nonce.String(), p.Deadline.String()))
		if got != want {
			t.Fatalf("case %d (name %q, version %q, chain %s): digest %s, apitypes %s", i, name, version, chainID, got, want)
		}
	}
}

func TestPermit2DigestMatchesGoEthereumTypedDataHashing(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for i := range 300 {
		chainID, permit2 := randChainID(r), randAddress(r)
		if i%3 == 0 {
			permit2 = canonicalPermit2
		}
		p := permit2Transfer{
			Token:      randAddress(r),
			Amount:     randUint256(r),
			Spender:    randAddress(r),
			Nonce:      randUint256(r),
			Deadline:   randUint256(r),
			To:         randAddress(r),
			ValidAfter: randUint256(r),
		}
		got := permit2Digest(permit2DomainSeparator(chainID, permit2), p)
		want := referenceDigest(t, chaintest.Permit2WitnessTypedData(chainID, permit2,
			p.Token.Hex(), p.Amount.String(), p.Spender.Hex(), p.Nonce.String(), p.Deadline.String(),
			p.To.Hex(), p.ValidAfter.String()))
		if got != want {
			t.Fatalf("case %d (chain %s): digest %s, apitypes %s", i, chainID, got, want)
		}
	}
}

func TestUptoDigestMatchesGoEthereumTypedDataHashing(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for i := range 300 {
		chainID, permit2 := randChainID(r), randAddress(r)
		if i%3 == 0 {
			permit2 = canonicalPermit2
		}
		p := permit2Transfer{
			Token:       randAddress(r),
			Amount:      randUint256(r),
			Spender:     randAddress(r),
			Nonce:       randUint256(r),
			Deadline:    randUint256(r),
			To:          randAddress(r),
			Facilitator: randAddress(r),
			ValidAfter:  randUint256(r),
		}
		got := uptoDigest(permit2DomainSeparator(chainID, permit2), p)
		want := referenceDigest(t, chaintest.UptoWitnessTypedData(chainID, permit2,
			p.Token.Hex(), p.Amount.String(), p.Spender.Hex(), p.Nonce.String(), p.Deadline.String(),
			p.To.Hex(), p.Facilitator.Hex(), p.ValidAfter.String()))
		if got != want {
			t.Fatalf("case %d (chain %s): digest %s, apitypes %s", i, chainID, got, want)
		}
		if exact := permit2Digest(permit2DomainSeparator(chainID, permit2), p); exact == got {
			t.Fatalf("case %d: the upto digest equals the exact one: the facilitator is not signed", i)
		}
	}
}

func TestDigestsTreatNilNumbersAsZero(t *testing.T) {
	zero := big.NewInt(0)
	domain := common.HexToHash("0x01")
	if PermitDigest(domain, Permit{}) != PermitDigest(domain, Permit{Value: zero, Nonce: zero, Deadline: zero}) {
		t.Error("Permit digest with nil numbers differs from the one with zeros")
	}
	if permit2Digest(domain, permit2Transfer{}) != permit2Digest(domain, permit2Transfer{Amount: zero, Nonce: zero, Deadline: zero, ValidAfter: zero}) {
		t.Error("Permit2 digest with nil numbers differs from the one with zeros")
	}
}

func TestNumbersOutsideUint256AreEncodedModulo2To256(t *testing.T) {
	two256 := new(big.Int).Lsh(big.NewInt(1), 256)
	cases := []struct {
		in   *big.Int
		want string
	}{
		{big.NewInt(-1), "0xffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"},
		{new(big.Int).Set(two256), "0x0000000000000000000000000000000000000000000000000000000000000000"},
		{new(big.Int).Add(two256, big.NewInt(5)), "0x0000000000000000000000000000000000000000000000000000000000000005"},
	}
	for _, c := range cases {
		before := new(big.Int).Set(c.in)
		var w [32]byte
		putUint256(w[:], c.in)
		if common.Hash(w) != common.HexToHash(c.want) {
			t.Errorf("putUint256(%s) = %x, want %s", before, w, c.want)
		}
		if c.in.Cmp(before) != 0 {
			t.Errorf("putUint256 changed its argument from %s to %s", before, c.in)
		}
	}
}

func TestDomainCacheReturnsTheSeparatorsItCaches(t *testing.T) {
	var c domainCache
	chainID := big.NewInt(72344)
	token := common.HexToAddress("0x1111111111111111111111111111111111111111")
	for range 2 {
		if got, want := c.Permit("Stable Coin", "1", chainID, token), PermitDomainSeparator("Stable Coin", "1", chainID, token); got != want {
			t.Fatalf("cached permit domain %s, want %s", got, want)
		}
		if got, want := c.Permit2(chainID, canonicalPermit2), permit2DomainSeparator(chainID, canonicalPermit2); got != want {
			t.Fatalf("cached Permit2 domain %s, want %s", got, want)
		}
	}
	if c.Len() != 2 {
		t.Fatalf("cache holds %d domains after two distinct ones asked twice, want 2", c.Len())
	}
	// Same fields but a different kind, version or chain must not collide.
	if c.Permit("Stable Coin", "2", chainID, token) == c.Permit("Stable Coin", "1", chainID, token) {
		t.Error("versions 1 and 2 share a cached separator")
	}
	if c.Permit2(big.NewInt(723487), canonicalPermit2) == c.Permit2(chainID, canonicalPermit2) {
		t.Error("two chains share a cached Permit2 separator")
	}
}

func TestDomainCacheStaysBoundedUnderManyDomains(t *testing.T) {
	var c domainCache
	for i := range 3 * domainCacheLimit {
		c.Permit(fmt.Sprintf("token %d", i), "1", big.NewInt(1), common.Address{})
		if n := c.Len(); n > domainCacheLimit {
			t.Fatalf("cache holds %d domains, limit %d", n, domainCacheLimit)
		}
	}
	// Still correct after starting over.
	if got, want := c.Permit("token 1", "1", big.NewInt(1), common.Address{}), PermitDomainSeparator("token 1", "1", big.NewInt(1), common.Address{}); got != want {
		t.Fatalf("separator after eviction %s, want %s", got, want)
	}
}

func TestDomainCacheIsSafeForConcurrentUse(t *testing.T) {
	var c domainCache
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				chainID := big.NewInt(int64(i%20 + g))
				token := common.BigToAddress(big.NewInt(int64(i % 7)))
				if c.Permit("Stable Coin", "1", chainID, token) != stableCoinDomain(chainID, token) {
					t.Errorf("goroutine %d: wrong permit domain for chain %s", g, chainID)
					return
				}
				if c.Permit2(chainID, token) != permit2DomainSeparator(chainID, token) {
					t.Errorf("goroutine %d: wrong Permit2 domain for chain %s", g, chainID)
					return
				}
			}
		})
	}
	wg.Wait()
}

// stableCoinDomain is the uncached "Stable Coin" / "1" domain.
func stableCoinDomain(chainID *big.Int, token common.Address) common.Hash {
	return PermitDomainSeparator(x402.DefaultTokenName, x402.DefaultTokenVersion, chainID, token)
}

func TestDigestsDoNotAllocate(t *testing.T) {
	domain := permit2DomainSeparator(big.NewInt(72344), canonicalPermit2)
	p := permit2Transfer{Amount: big.NewInt(1000), Nonce: big.NewInt(7), Deadline: big.NewInt(1 << 40), ValidAfter: big.NewInt(0)}
	if n := testing.AllocsPerRun(100, func() { permit2Digest(domain, p) }); n != 0 {
		t.Errorf("permit2Digest allocates %v times per call, want 0", n)
	}
	pp := Permit{Value: big.NewInt(1000), Nonce: big.NewInt(7), Deadline: big.NewInt(1 << 40)}
	if n := testing.AllocsPerRun(100, func() { PermitDigest(domain, pp) }); n != 0 {
		t.Errorf("PermitDigest allocates %v times per call, want 0", n)
	}
	var c domainCache
	c.Permit2(big.NewInt(72344), canonicalPermit2)
	if n := testing.AllocsPerRun(100, func() { c.Permit2(big.NewInt(72344), canonicalPermit2) }); n > 1 {
		t.Errorf("a cached Permit2 domain lookup allocates %v times, want at most 1 (the chain ID)", n)
	}
}

// Keep the reference hash honest: apitypes must refuse a message whose field is missing, or a test that
// compares against it could pass on two equal mistakes.
func TestReferenceHashingRefusesAnIncompleteMessage(t *testing.T) {
	td := chaintest.PermitTypedData("Stable Coin", "1", big.NewInt(1), common.Address{}, common.Address{}.Hex(), common.Address{}.Hex(), "1", "0", "1")
	delete(td.Message, "deadline")
	if _, _, err := apitypes.TypedDataAndHash(td); err == nil {
		t.Fatal("apitypes hashed a Permit without deadline")
	}
}

func TestTransferAuthorizationDigestMatchesGoEthereumTypedDataHashing(t *testing.T) {
	if transferWithAuthorizationTypeHash != common.HexToHash("0x7c7c6cdb67a18743f49ec6fa9b35f50d52ed05cbed4cc592e13b44501c1a2267") {
		t.Fatalf("TransferWithAuthorization type hash = %s, want USDC's 0x7c7c6cdb…2267", transferWithAuthorizationTypeHash)
	}
	r := rand.New(rand.NewPCG(5, 6))
	for i := range 300 {
		name, version := randString(r), randString(r)
		chainID, token := randChainID(r), randAddress(r)
		var nonce common.Hash
		for j := range nonce {
			nonce[j] = byte(r.Uint32())
		}
		a := transferAuthorization{From: randAddress(r), To: randAddress(r), Value: randUint256(r),
			ValidAfter: randUint256(r), ValidBefore: randUint256(r), Nonce: nonce}
		got := transferAuthorizationDigest(PermitDomainSeparator(name, version, chainID, token), a)
		want := referenceDigest(t, chaintest.TransferAuthorizationTypedData(name, version, chainID, token,
			a.From.Hex(), a.To.Hex(), a.Value.String(), a.ValidAfter.String(), a.ValidBefore.String(), a.Nonce.Hex()))
		if got != want {
			t.Fatalf("case %d: digest %s, apitypes %s", i, got, want)
		}
	}
}
