package kafkabroker

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Provision creates topic with partitions partitions, each on replicas
// brokers, and min.insync.replicas of replicas-1 (at least 1), so that
// acks=all means a record survives a broker lost; a topic that exists is
// left as it is. Run it apart from the services, as a step of its own.
func Provision(ctx context.Context, cl *kgo.Client, topic string, partitions int32, replicas int16) error {
	if !topicName(topic) || partitions < 1 || replicas < 1 {
		return fmt.Errorf("kafkabroker: Provision %q, %d partitions, %d replicas: want a topic's name and at least one of each", topic, partitions, replicas)
	}
	minISR := fmt.Sprint(max(replicas-1, 1))
	req := kmsg.NewPtrCreateTopicsRequest()
	t := kmsg.NewCreateTopicsRequestTopic()
	t.Topic, t.NumPartitions, t.ReplicationFactor = topic, partitions, replicas
	c := kmsg.NewCreateTopicsRequestTopicConfig()
	c.Name, c.Value = "min.insync.replicas", &minISR
	t.Configs = append(t.Configs, c)
	req.Topics = append(req.Topics, t)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return fmt.Errorf("kafkabroker: create topic %s: %w", topic, err)
	}
	for _, rt := range resp.Topics {
		if err := kerr.ErrorForCode(rt.ErrorCode); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
			return fmt.Errorf("kafkabroker: create topic %s: %w", topic, err)
		}
	}
	return nil
}
