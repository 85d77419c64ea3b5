package chain

import (
	"context"
	"errors"
	"testing"

	"github.com/ethereum/go-ethereum/common"
)

// A Failover whose endpoint is a node in this process reads storage from that node's state, without RPC; one
// with no such endpoint says so, and the batcher falls back to the RPC (here: nothing to batch through).
func TestStorageReadsGoToANodeInThisProcessWithoutRPC(t *testing.T) {
	var asked []common.Hash
	local := AttachedClient(nil, func(_ context.Context, _ common.Address, slot common.Hash) ([]byte, error) {
		asked = append(asked, slot)
		return slot.Bytes(), nil
	})
	fo, err := NewFailover([]string{"in process"}, []Backend{local})
	if err != nil {
		t.Fatal(err)
	}
	cb := &callBatcher{backend: fo}
	slot := common.HexToHash("0x1234")
	got, err := cb.storageAt(context.Background(), common.Address{}, slot)
	if err != nil || common.BytesToHash(got) != slot || len(asked) != 1 {
		t.Fatalf("storageAt = %x, %v after %d local reads; want the slot's value read locally once", got, err, len(asked))
	}
	remote, err := NewFailover([]string{"remote"}, []Backend{&RPCClient{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := remote.LocalStorageAt(context.Background(), common.Address{}, slot); !errors.Is(err, errNoLocalStorage) {
		t.Fatalf("a Failover with no node in this process: %v, want errNoLocalStorage", err)
	}
}
